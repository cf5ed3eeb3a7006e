"""Language-model losses that never hold the full logits tensor."""
