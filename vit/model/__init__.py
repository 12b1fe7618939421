"""The network as a flat list of timm layers, its loss, and weights in (pretrained) and out
(--export)."""
