"""loraplex: multi-tenant LoRA fine-tuning on one shared frozen base model."""

__version__ = "0.1.0"
