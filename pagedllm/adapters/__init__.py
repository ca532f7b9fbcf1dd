"""Adapters (LoRA) in PEFT's file format: made by the trainer, interchangeable with Hugging Face PEFT."""
