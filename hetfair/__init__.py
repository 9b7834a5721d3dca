"""hetfair: train PyTorch models on heterogeneous clusters."""

from hetfair.criteria import register_criterion
from hetfair.models import register_model, register_model_architecture
from hetfair.optim import register_lr_scheduler, register_optimizer
from hetfair.parallel import register_comm_hook, register_strategy
from hetfair.tasks import register_task

__version__ = "0.1.0"



def __getattr__(name: str) -> object:
    if name == "load_model":  # imported on first use: training never needs it
        from hetfair.pretrained import load_model

        return load_model
    raise AttributeError(f"module 'hetfair' has no attribute '{name}'")


__all__ = [
    "load_model",
    "register_task",
    "register_model",
    "register_model_architecture",
    "register_criterion",
    "register_optimizer",
    "register_lr_scheduler",
    "register_strategy",
    "register_comm_hook",
    "__version__",
]
