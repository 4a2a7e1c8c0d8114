"""Tests read TensorBoard scalars through the library's reader."""

from megatron_ext.training.tensorboard import scalars  # noqa: F401
