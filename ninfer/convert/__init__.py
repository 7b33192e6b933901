"""Conversion of GGUF / safetensors sources into one .ninfer artifact, driven by named recipes."""

from ninfer.convert.job import ConversionJob, ConvertRequest
from ninfer.convert.plans import TensorPlan, carry, computed, transform
from ninfer.convert.registry import Recipe, get_recipe, recipe, recipe_names
from ninfer.convert.run import ConversionResult, convert

__all__ = [
    "ConversionJob",
    "ConversionResult",
    "ConvertRequest",
    "Recipe",
    "TensorPlan",
    "carry",
    "computed",
    "convert",
    "get_recipe",
    "recipe",
    "recipe_names",
    "transform",
]
