"""Example ``--user-dir`` plugin: the ``mnist`` task with the ``mnist_cnn`` and ``mnist_mlp`` models.

``hetfair-train --user-dir plugins --task mnist --data DIR`` imports this
package; importing the modules below registers their components.
"""

from . import mnist_models, mnist_task

__all__ = ["mnist_models", "mnist_task"]
