"""The megatron features the plugin adapts, one module each (see :mod:`.base`)."""
