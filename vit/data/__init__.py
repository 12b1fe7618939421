"""Data sets, the step-indexed sampling every engine shares, and timm's augmentation and Mixup on
top."""
