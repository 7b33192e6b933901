"""Built-in conversion recipes; each module registers its recipes with `ninfer.convert.registry.recipe`."""
