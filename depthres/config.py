"""
Training configuration: TrainConfig (the training keys), and a run's config read from a config file and
--key=value overrides (train.py's docstring says how), each value checked against its key's type (model
keys: model.GPTConfig, checked by model_config).
"""

import difflib
import math
import runpy
import traceback
import types
import typing
import unicodedata
from contextlib import suppress
from dataclasses import dataclass, field, fields
from pathlib import Path

from depthres import UserError
from model import DAR_STREAMS, RD_MODES, RESIDUALS, DeltaAttnRes, DenseFormer, DualAttnRes, GPTConfig, RDAttnRes

FLOAT32_TINY = 2.0**-126  # float32's smallest normal number


def control_character(text):
    """(position, character) of the first control character in `text` (C0 such as newline, ESC or BEL,
    DEL, C1, a Unicode line or paragraph separator, or an invisible format character such as a right-to-left
    override or a zero-width space), or None. Such a character in a name that is printed or becomes a path
    could forge log lines, reorder what is shown, or hide in a directory name."""
    return next(((i, c) for i, c in enumerate(text) if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)


def check_printable(name, text):
    """A UserError when `text`, the value of `name`, holds a control character."""
    found = control_character(text)
    if found is not None:
        raise UserError(
            f"{name} holds a control character ({found[1]!r} at position {found[0]}), got {text!r}: names that "
            "are printed or become paths may not hold newlines, escapes or other control characters")


def need(ok, message):
    """A UserError(message) unless ok: bad input is one line, said before any compute."""
    if not ok:
        raise UserError(message)


def key(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    data_dir: str = key("data/shakespeare", "prepared data (prepare_data.py); its meta.json names the tokenizer")
    out_dir: str = key("runs", "runs live in out_dir/run_name")
    run_name: str = key("", "default: the config file's name")
    resume: str = key("", "true: continue the run directory's checkpoint; or a run directory or checkpoint file")
    overwrite: bool = key(False, "start afresh in a run directory that holds a run, deleting that run")
    seed: int = key(0, "model init, make_model(cfg, seed); also torch's global seed")
    data_seed: int = key(0, "order of the training batches")
    batch_tokens: int = key(8192, "tokens per optimizer step, all ranks together")
    batch_size: int = key(8, "sequences per micro-batch on each rank")
    seq_len: int = key(256, "tokens per sequence; the model's block_size follows it unless set")
    max_steps: int = key(0, "optimizer steps; 0: max_tokens // batch_tokens")
    max_tokens: int = key(0, "token budget, used when max_steps is 0")
    lr: float = key(3e-3, "peak learning rate")
    min_lr: float = key(3e-4, "learning rate at the end of the schedule")
    lr_schedule: str = key("cosine", "cosine: warmup, cosine to min_lr | wsd: warmup, constant, linear decay to min_lr")
    warmup_steps: int = key(100, "linear warmup from lr / warmup_steps to lr")
    decay_frac: float = key(0.2, "wsd: fraction of max_steps spent decaying")
    weight_decay: float = key(0.1, "AdamW, on matrices only (model.param_groups)")
    beta1: float = key(0.9, "AdamW")
    beta2: float = key(0.95, "AdamW")
    eps: float = key(1e-8, "AdamW")
    grad_clip: float = key(1.0, "max global gradient norm; 0: off")
    eval_interval: int = key(250, "steps between validation evaluations (and one at the end)")
    eval_tokens: int = key(65536, "tokens per evaluation: a fixed prefix of the split, shared among ranks")
    log_interval: int = key(10, "steps between log lines")
    ckpt_interval: int = key(1000, "steps between checkpoints (and one at the end); 0: only at the end")
    device: str = key("auto", "auto (cuda if available) | cpu | cuda; with torchrun, rank r uses cuda:LOCAL_RANK")
    compile: bool = key(False, "torch.compile the model")
    fsdp: bool = key(False, "with torchrun: shard parameters, gradients and AdamW state over the ranks (FSDP2) "
                            "instead of replicating them (DDP)")
    wandb_log: bool = key(False, "log the config and every train/eval record to W&B (rank 0; pip install wandb)")
    wandb_project: str = key("depth-routing", "W&B project")
    wandb_run_name: str = key("", "W&B run name; default: run_name")
    wandb_group: str = key("", "W&B group (sweep.py: the sweep's name)")
    wandb_tags: str = key("", "comma-separated W&B tags (sweep.py: the variant and seed<s>)")

    def __post_init__(self):
        for name, typ in TRAIN_TYPES.items():  # run_name, out_dir, data_dir, resume, the W&B names, ..
            if typ is str:
                check_printable(name, getattr(self, name))
        for name in ("seed", "data_seed"):
            need(0 <= getattr(self, name) < 2**32, f"{name} must be in [0, 2**32), got {getattr(self, name)}")
        for name, typ in TRAIN_TYPES.items():
            if typ is float:
                need(math.isfinite(getattr(self, name)), f"{name} must be a finite number, got {getattr(self, name)}")
        for name in ("batch_tokens", "batch_size", "seq_len", "eval_interval", "eval_tokens", "log_interval"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "max_tokens", "warmup_steps", "ckpt_interval", "weight_decay", "grad_clip"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.max_steps > 0 or self.max_tokens >= self.batch_tokens,
             f"set max_steps, or max_tokens of at least batch_tokens={self.batch_tokens} "
             f"(got max_tokens={self.max_tokens})")
        need(0 <= self.min_lr <= self.lr and self.lr > 0,
             f"need 0 <= min_lr <= lr and lr > 0, got min_lr={self.min_lr}, lr={self.lr}")
        # AdamW's update is m / (sqrt(v) + eps): a parameter whose gradient is 0 (an embedding row no batch
        # used) has m = v = 0, so eps = 0 (or one below float32's smallest normal, which rounds to 0) is 0/0
        need(self.eps >= FLOAT32_TINY, f"eps must be > 0 (AdamW divides by sqrt(v) + eps, and v = 0 for a parameter "
             f"whose gradient is 0: NaN) and at least float32's smallest normal {FLOAT32_TINY:.3g}, got {self.eps}; "
             "the default is 1e-8")
        need(self.eval_tokens >= self.seq_len, f"eval_tokens={self.eval_tokens} is less than one sequence of "
             f"seq_len={self.seq_len} tokens: set eval_tokens >= {self.seq_len}")
        need(self.lr_schedule in ("cosine", "wsd"), f"lr_schedule must be cosine or wsd, got {self.lr_schedule!r}")
        need(0 <= self.decay_frac <= 1, f"decay_frac must be in [0, 1], got {self.decay_frac}")
        need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        need(self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {self.device!r}")
        need(not (self.overwrite and self.resume.lower() in ("true", "1")),
             "resume=true continues the run that overwrite=true would delete: pass one of them")
        need(self.wandb_project and not set(self.wandb_project) & set("/\\#?%:"),
             f"wandb_project must be a non-empty name without / \\ # ? % :, got {self.wandb_project!r}")
        for tag in self.tags():
            need(len(tag) <= 64, f"wandb_tags: a W&B tag is at most 64 characters, got {tag!r}")
        need(self.run_name == "" or (Path(self.run_name).name == self.run_name and self.run_name not in (".", "..")
                                     and "\\" not in self.run_name),
             f"run_name must be a plain directory name inside out_dir (no /, \\ or ..), got {self.run_name!r}: "
             "put the path in out_dir")

    def tags(self):
        return [t.strip() for t in self.wandb_tags.split(",") if t.strip()]


TRAIN_TYPES = typing.get_type_hints(TrainConfig)
MODEL_TYPES = typing.get_type_hints(GPTConfig)


def type_name(typ):
    return " | ".join("None" if t is type(None) else t.__name__ for t in typing.get_args(typ)) or typ.__name__


def convert(name, value, typ):
    """`value` (a command-line string or a config file's Python value) as type `typ`."""
    args = typing.get_args(typ)
    if type(None) in args:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        (typ,) = [t for t in args if t is not type(None)]
    text = isinstance(value, str)
    if typ is str and text:
        return value
    if typ is bool:
        word = value.lower() if text else value
        if word in ("true", "1", 1):  # True == 1
            return True
        if word in ("false", "0", 0):
            return False
    if typ is float and not isinstance(value, bool):
        with suppress(TypeError, ValueError):
            return float(value)
    if typ is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        with suppress(TypeError, ValueError):
            if text and value.strip().lstrip("+-").isdigit():
                return int(value)
            if float(value).is_integer():  # 1e5, 2.0
                return int(float(value))
    raise UserError(f"{name} expects {'true/false/1/0' if typ is bool else type_name(typ)}, got {value!r}")


def check_key(name, where):
    if name in TRAIN_TYPES or name in MODEL_TYPES:
        return name
    close = difflib.get_close_matches(name, [*TRAIN_TYPES, *MODEL_TYPES], n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise UserError(f"unknown key {name!r} in {where}{hint} (python train.py --help lists every key)")


def read_config_file(path):
    """The keys a config file assigns (its names that are not private, modules, functions or classes)."""
    if not Path(path).is_file():
        raise UserError(f"config file {path} not found")
    try:
        names = runpy.run_path(str(path))
    except SyntaxError as e:
        raise UserError(f"config file {path}, line {e.lineno}: syntax error: {e.msg}") from None
    except (Exception, SystemExit) as e:  # the file ran and raised (or called sys.exit): name its line
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__))
                     if Path(f.filename).resolve() == Path(path).resolve()), "?")
        raise UserError(f"config file {path}, line {line}: {type(e).__name__}: {e}") from None
    return {k: v for k, v in names.items()  # (what it imports or defines to compute with is no key)
            if not k.startswith("_") and not isinstance(v, types.ModuleType) and not callable(v)}


def parse_config(argv):
    """argv = [CONFIG, --key=value, ...] -> (TrainConfig, the model keys that were set)."""
    if not argv or argv[0].startswith("-"):
        raise UserError("usage: python train.py CONFIG [--key=value ...]  (--help lists the keys)")
    path, overrides = argv[0], argv[1:]
    settings = {}
    for name, value in read_config_file(path).items():
        settings[check_key(name, path)] = value
    for arg in overrides:
        if not arg.startswith("--") or "=" not in arg:
            raise UserError(f"expected --key=value, got {arg!r}")
        name, value = arg[2:].split("=", 1)
        settings[check_key(name, "the command line")] = value
    settings = {k: convert(k, v, TRAIN_TYPES.get(k) or MODEL_TYPES[k]) for k, v in settings.items()}
    train = {k: v for k, v in settings.items() if k in TRAIN_TYPES}
    train["run_name"] = train.get("run_name") or Path(path).stem
    return TrainConfig(**train), {k: v for k, v in settings.items() if k in MODEL_TYPES}


def build_model_config(model_settings, tc, meta):
    """GPTConfig from the keys that were set; vocab_size defaults to the data's vocabulary padded to
    a multiple of 64, block_size to seq_len."""
    kv = {"vocab_size": 64 * math.ceil(meta["vocab_size"] / 64), "block_size": tc.seq_len, **model_settings}
    if kv["vocab_size"] < meta["vocab_size"]:
        raise UserError(f"vocab_size={kv['vocab_size']} is smaller than the {meta['tokenizer']} "
                        f"tokenizer's {meta['vocab_size']}")
    if kv["block_size"] < tc.seq_len:
        raise UserError(f"block_size={kv['block_size']} is shorter than seq_len={tc.seq_len}")
    try:
        return model_config(kv)
    except UserError as e:
        raise UserError(f"model config: {e}") from None


DEPTH_IMPLS = ("two_phase", "reference")
# A flag of one family of variants: the class its residual must be (or subclass), so a subclass gets its flags
FLAG_OWNERS = {"rd_mode": RDAttnRes, "dar_routing": DualAttnRes, "denseformer_dilation": DenseFormer,
               "denseformer_period": DenseFormer, "delta_block_size": DeltaAttnRes}


def model_config(settings):
    """model.GPTConfig(**settings), each value checked: a bad one is a UserError (one line that says what to do)."""
    unknown = sorted(set(settings) - set(MODEL_TYPES))
    need(not unknown, f"unknown model key {unknown[0]!r}" if unknown else "")
    c = GPTConfig(**settings)

    need(c.residual in RESIDUALS, f"unknown residual {c.residual!r}; choose one of {', '.join(RESIDUALS)}")
    for name, owner in FLAG_OWNERS.items():
        value, owners = getattr(c, name), [r for r, cls in RESIDUALS.items() if issubclass(cls, owner)]
        need(value is None or issubclass(RESIDUALS[c.residual], owner),
             f"{name}={value!r} only applies to residual={' or '.join(map(repr, owners))} (got residual="
             f"{c.residual!r}); drop {name}")
    for name, choices in (("rd_mode", RD_MODES), ("dar_routing", tuple(DAR_STREAMS)), ("depth_impl", DEPTH_IMPLS)):
        value = getattr(c, name)
        need(value is None or value in choices, f"unknown {name} {value!r}; choose one of {', '.join(choices)}")
    layers, sublayers = " counts transformer layers and", " counts sublayers and"
    for name, unit in (("vocab_size", ""), ("block_size", ""), ("n_layer", ""), ("n_head", ""), ("n_embd", ""),
                       ("mlp_ratio", ""), ("mlp_hidden", ""), ("hc_streams", ""), ("dar_block_size", layers),
                       ("attnres_block_size", sublayers), ("delta_block_size", sublayers), ("depth_chunk", sublayers)):
        value = getattr(c, name)
        need(value is None or value >= 1, f"{name}{unit} must be >= 1, got {value}")
    for name in ("denseformer_dilation", "denseformer_period"):
        value = getattr(c, name)
        need(value is None or 1 <= value <= c.n_layer,
             f"{name} counts transformer layers and must be between 1 and n_layer={c.n_layer}, got {value}")
    need(c.n_embd % c.n_head == 0, f"n_embd={c.n_embd} is not divisible by n_head={c.n_head}")
    need((c.n_embd // c.n_head) % 2 == 0,
         f"head dim n_embd/n_head={c.n_embd // c.n_head} must be even for rotary embeddings")
    need(math.isfinite(c.logit_softcap) and c.logit_softcap >= 0,
         f"logit_softcap must be a finite number >= 0, got {c.logit_softcap}")
    need(math.isfinite(c.rope_base) and c.rope_base > 0,
         f"rope_base must be a finite number > 0 (rotary frequencies are base^(-2i/head_dim)), got {c.rope_base}")
    return c


def total_steps(tc):
    return tc.max_steps or tc.max_tokens // tc.batch_tokens


def usage(doc):
    """--help: `doc` (train.py's docstring), then every key with its type, default and meaning."""
    lines = [doc.strip(), "", "training keys:"]
    lines += [f"  {f.name:<14} {type_name(TRAIN_TYPES[f.name]):<6} {f.default!r:<20} {f.metadata['help']}"
              for f in fields(TrainConfig)]
    lines += ["", "model keys (model.GPTConfig; vocab_size defaults to the data's, padded to a multiple of 64):"]
    lines += [f"  {f.name:<24} {type_name(MODEL_TYPES[f.name]):<11} {f.default!r}" for f in fields(GPTConfig)]
    return "\n".join(lines)
