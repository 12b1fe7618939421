"""Benchmarks: numbers to read in docs/benchmarks.md, never assertions in tests. One launcher:

    python -m bench train       every engine against the plain single-process loop (images/s, MFU)
    python -m bench allreduce   all-reduce bandwidth (run under mpirun)
    python -m bench peak        this machine's GEMM FLOP/s
    python -m bench mixed       balanced stages and proportional batches with slowed ranks
    python -m bench lossscale   fp16 skipped steps: DeepSpeed's loss scale against --loss-scale auto
    python -m bench monitor     what one monitor sample costs
    python -m bench recipe      the default job with each recipe option on and off (top-1, time)
    python -m bench compare     two configurations over paired seeds: B - A with its standard error
    python -m bench finetune    fine-tuning from a model this project pretrained, against scratch
    python -m bench glyph-split the glyphs task as letters to pretrain on and digits to fine-tune on
    python -m bench freeze      freeze training's breakdown (PipeTransformer's Table 1) on 2 ranks
    python -m bench async-pipeline  the async pipeline against DeepSpeed's and the no-bubble ideal
    python -m bench planner     the planner's predicted step times against real runs; auto's rank
    python -m bench calibrate   the planner's fixed costs fitted to several `bench planner` runs
    python -m bench gpu         the GPU acceptance check: engines on one device, fp16, syncs, MFU

`python -m bench COMMAND --help` for each.
"""
