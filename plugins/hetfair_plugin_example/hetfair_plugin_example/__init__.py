"""Example hetfair plugin: synthetic regression task, MLP model, summed MSE criterion.

Importing the package registers everything (so it also works as ``--user-dir``);
installed, hetfair imports it only when one of its entry-point names is chosen.
"""

from hetfair_plugin_example import criterion, model, task

__all__ = ["criterion", "model", "task"]
