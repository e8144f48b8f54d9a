"""Megatron integration: ``install()``, the ``--pipeline-schedule`` flags, layer-placement hooks, CPU mode.

Submodules are imported on use: :mod:`.cpu` must be able to run before megatron is imported.
"""
