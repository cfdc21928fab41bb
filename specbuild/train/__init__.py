"""Training (torch): the demo pair and draft distillation. The compiler never imports it."""
