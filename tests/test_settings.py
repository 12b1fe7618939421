"""The command line as typed settings: defaults without parsing, every number checked (NaN and
infinity too), checks between options, and --data-path never ignored."""

import pytest

from vit.core.errors import ConfigError
from vit.core.settings import DataSettings
from vit.data.datasets import dataset_for
from vit.engines.registry import Settings
from vit.run.cli import defaults, parse, parser


def test_defaults_need_no_command_line():
    s = defaults()
    assert s == parse([])
    assert s.optim.lr == 2e-3 and s.parallel.engine == "zero"
    # no length given: 40 epochs (vit.run.plan.run_length), or with --resume the run's own
    assert s.train.epochs is None and s.train.steps is None
    assert s.parallel.ds_config.endswith("deepspeed_configs/zero2.json")
    assert s.checkpoint.save_interval == 1000  # a long run stopped loses at most that many steps
    assert parse(["--engine", "ddp"]).parallel.ds_config.endswith("zero0.json")
    assert s.with_(lr=0.1, engine="pipeline").optim.lr == 0.1
    with pytest.raises(TypeError, match="unknown settings: nope"):
        s.with_(nope=1)


def test_every_option_is_in_flat_and_in_help():
    flat, text = Settings().flat(), parser().format_help()
    for name in flat:
        if name != "local_rank":
            assert "--" + name.replace("_", "-") in text, name


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--lr", "nan"], "--lr must be a finite number, got nan"),
        (["--epochs", "inf"], "--epochs must be a finite number, got inf"),
        (["--dist-timeout", "nan"], "--dist-timeout must be a finite number, got nan"),
        (["--monitor-interval", "nan"], "--monitor-interval must be a finite number, got nan"),
        (["--monitor-interval", "-1"], "--monitor-interval must not be negative, got -1.0"),
        (["--weight-decay", "-0.1"], "--weight-decay must not be negative, got -0.1"),
        (["--hflip", "1.5"], "--hflip must be between 0 and 1, got 1.5"),
        (["--mixup-prob", "-0.5"], "--mixup-prob must be between 0 and 1, got -0.5"),
        (["--opt", "sgd", "--momentum", "1"], "--momentum must be at least 0 and below 1, got 1.0"),
        (["--smoothing", "1"], "--smoothing must be at least 0 and below 1, got 1.0"),
        (
            ["--model-ema", "--model-ema-decay", "1.5"],
            "--model-ema-decay must be at least 0 and below 1, got 1.5",
        ),
        (["--scale", "nan", "1"], "--scale must be a finite number, got nan 1.0"),
        (
            ["--scale", "0.9", "0.5"],
            "--scale MIN MAX: a share of the image's area, 0 < MIN <= MAX <= 1, got 0.9 0.5",
        ),
        (
            ["--scale", "0.5", "2"],
            "--scale MIN MAX: a share of the image's area, 0 < MIN <= MAX <= 1, got 0.5 2.0",
        ),
        (["--lr", "0.01", "--min-lr", "0.1"], "--min-lr 0.1 is above --lr 0.01"),
        (["--steps", "0"], "--steps must be positive, got 0"),
        (["--steps", "3", "--epochs", "2"], "argument --epochs: not allowed with argument --steps"),
        (["--engine", "tpu"], "argument --engine: invalid choice: 'tpu'"),
        (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
        (
            ["--partition", "random"],
            "--partition must be uniform, parameters, balanced or type:REGEX",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_option(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(argv)


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--freeze-alpha", "0.5"],
            "--freeze-alpha has no effect without --freeze schedule, settled or grad",
        ),
        (
            ["--engine", "pipeline", "--freeze-interval-epochs", "2"],
            "--freeze-interval-epochs has no effect without --freeze schedule, settled or grad",
        ),
        (
            ["--freeze-cache", "off"],
            "--freeze-cache has no effect without --freeze schedule, settled or grad",
        ),
        (
            ["--freeze-cache-gib", "1"],
            "--freeze-cache-gib has no effect without --freeze schedule, settled or grad",
        ),
        (
            ["--engine", "pipeline", "--freeze-replan", "off"],
            "--freeze-replan has no effect without --freeze schedule, settled or grad on --engine "
            "pipeline",
        ),
        (
            ["--freeze", "grad", "--freeze-replan", "off"],
            "--freeze-replan has no effect without --freeze schedule, settled or grad on --engine "
            "pipeline",
        ),
        (
            ["--engine", "pipeline", "--async-update-interval", "2"],
            "--async-update-interval has no effect without --engine async-pipeline",
        ),
        (
            ["--weight-prediction", "none"],
            "--weight-prediction has no effect without --engine async-pipeline",
        ),
    ],
)
def test_an_option_without_effect_is_refused_naming_what_it_needs(argv, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        parse(argv)


def test_options_with_what_they_need_are_taken():
    s = parse(
        [
            "--engine",
            "pipeline",
            "--freeze",
            "grad",
            "--freeze-alpha",
            "0.5",
            "--freeze-replan",
            "off",
            "--freeze-interval-epochs",
            "2",
            "--freeze-cache",
            "off",
            "--freeze-cache-gib",
            "1",
        ]
    )
    assert (s.freeze.freeze_alpha, s.freeze.freeze_replan, s.freeze.freeze_cache_gib) == (
        0.5,
        "off",
        1.0,
    )
    assert (
        parse(
            ["--engine", "async-pipeline", "--weight-prediction", "none"]
        ).asynchrony.weight_prediction
        == "none"
    )


def test_data_path_is_read_or_refused_never_ignored(tmp_path):
    (tmp_path / "imgs" / "train").mkdir(parents=True)
    (tmp_path / "imgs" / "val").mkdir()
    (tmp_path / "cifar" / "cifar-10-batches-py").mkdir(parents=True)
    assert dataset_for(DataSettings()) == ("digits", None)
    name, note = dataset_for(DataSettings(data_path=str(tmp_path / "imgs")))
    assert name == "imagefolder" and "training on it (--dataset imagefolder)" in note
    assert dataset_for(DataSettings(data_path=str(tmp_path / "cifar")))[0] == "cifar10"
    assert dataset_for(DataSettings(dataset="cifar100", data_path=str(tmp_path / "x"))) == (
        "cifar100",
        None,
    )
    with pytest.raises(ConfigError, match="--dataset digits reads no files"):
        dataset_for(DataSettings(dataset="digits", data_path=str(tmp_path / "imgs")))
    with pytest.raises(ConfigError, match="not a CIFAR folder .* nor an image folder"):
        dataset_for(DataSettings(data_path=str(tmp_path)))


def test_digits_crop_by_default_and_no_aug_turns_every_augmentation_off():
    """The digits' default crop applies where --scale is not given; --no-aug (timm's) wins over
    every transform option and the default, and leaves mixup; other data sets have no default
    augmentation."""
    from vit.data.augment import data_recipe, train_dataset
    from vit.data.datasets import load_dataset

    digits, synthetic = (
        load_dataset("digits", None, 8),
        load_dataset("synthetic", None, 32, synthetic_size=64),
    )
    assert data_recipe(defaults().recipe, digits).scale == (0.95, 1.0)
    assert tuple(data_recipe(parse(["--scale", "0.5", "1"]).recipe, digits).scale) == (0.5, 1.0)
    off = data_recipe(
        parse(["--no-aug", "--scale", "0.5", "1", "--hflip", "0.5", "--mixup", "0.2"]).recipe,
        digits,
    )
    assert (off.scale, off.hflip, off.augments, off.mixup) == (None, 0.0, False, 0.2)
    # the plain tensors, not re-drawn per step
    assert train_dataset(digits, off, 0) == (digits.train, False)
    assert data_recipe(defaults().recipe, synthetic) == defaults().recipe


def test_the_settings_hash_that_guards_resume_tells_optimizers_apart():
    from vit.run.plan import make_plan
    from vit.runtime.dist_env import Job

    def settings_hash(*argv):
        return make_plan(parse(list(argv)), Job(0, 1, 0, 1, "single")).settings_hash()

    adamw = settings_hash()
    assert settings_hash("--momentum", "0.5") == adamw  # AdamW has no --momentum
    hashes = {
        settings_hash("--opt", "sgd"),
        settings_hash("--opt", "sgd", "--momentum", "0.5"),
        settings_hash("--opt", "sgd", "--nesterov"),
        adamw,
        settings_hash("--lr", "0.1"),
    }
    assert len(hashes) == 5
