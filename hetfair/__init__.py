"""hetfair: train PyTorch models on heterogeneous clusters."""

from hetfair.criteria import register_criterion
from hetfair.models import register_model, register_model_architecture
from hetfair.optim import register_lr_scheduler, register_optimizer
from hetfair.tasks import register_task

__version__ = "0.1.0"

__all__ = [
    "register_task",
    "register_model",
    "register_model_architecture",
    "register_criterion",
    "register_optimizer",
    "register_lr_scheduler",
    "__version__",
]
