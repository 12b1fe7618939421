"""The bottom layer: what every other package reads and nothing here imports from them. The
project's errors, the settings' types, the batch arithmetic, a pipeline's stage layout, the
checkout's paths, the engine spec every engine declares, and the cost model's vocabulary. No torch.
"""
