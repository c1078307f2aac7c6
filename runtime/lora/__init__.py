"""LoRA adapters on top of the base model: read from PEFT folders, kept in CPU memory and in
device slots, applied to a batch that mixes adapters (``ladle.runtime.kernels.lora``)."""
