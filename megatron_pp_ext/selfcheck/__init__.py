"""Self-checks: the plugin's own machinery (the B/W split, FSDP, replica sync, the GPU kit) checked on
real ranks or a device against a single-process reference, outside ``megatron-pp verify``."""
