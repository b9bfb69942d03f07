"""The model files: on this control plane's disk with their GGUF facts (store), held by each control plane and
pulled from one another (sync), and given to whoever fetches `/mirror/<sha256>` (serving)."""
