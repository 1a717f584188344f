"""The forward pass: the decoder's layer loop, attention, rotary embeddings, the weights'
in-memory form, the KV cache tensors, and the measured choice of linear kernel."""
