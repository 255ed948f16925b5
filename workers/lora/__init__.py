"""Multi-LoRA serving: PEFT adapters loaded, held in device slots and applied per token in a mixed batch."""
