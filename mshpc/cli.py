"""The `mshpc` command. Each subcommand is a small parser plus a function; knobs live in the
config, not in flags (`--set section.key=value` reaches every one of them)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from mshpc.errors import USER_ERROR_EXIT, ConfigError, LaunchError, MshpcError, print_error


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    """CONFIG and --set, which every command that runs a config takes alike."""
    p.add_argument("config", nargs=None if required else "?",
                   help="YAML config file, e.g. configs/tiny.yaml" + ("" if required else " (default: none)"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optim.lr=3e-4 (repeatable)")


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a model from a YAML config",
        description="Train a GPT model. Outside any launcher, starts --nproc local ranks (default: "
        "parallel.dp*tp*pp of the config); under srun, mpiexec or torchrun, runs as one of their ranks. "
        "The run directory is <run.out_dir>/<run.name>/ (config.yaml, metrics.jsonl).",
    )
    _add_config_args(p)
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="local ranks to start (outside a launcher); parallel.dp follows as N/(tp*pp)")
    p.set_defaults(func=cmd_train)


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare", help="tokenize records and text files into token shards",
        description="Tokenize JSONL (.jsonl, .ndjson, also .gz or .zst: one record a line), Parquet, "
        "Hugging Face datasets saved with save_to_disk (each record a document) and text files (each "
        "file a document; folders are walked recursively) into a dataset folder of token shards with "
        "an index, checksums and the tokenizer's files; point data.path at it.",
    )
    p.add_argument("inputs", nargs="+", type=Path, help="record files, saved datasets, text files or folders")
    p.add_argument("--out", required=True, type=Path, help="dataset folder to create")
    p.add_argument("--tokenizer", default="byte",
                   help="'byte' (default, needs nothing downloaded), a tokenizer.json, a Hugging Face model "
                   "folder (Llama 3, Qwen...), a SentencePiece .model or a tiktoken .tiktoken ranks file")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the field (JSONL) or column (Parquet, saved datasets) holding each record's text")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="skip and count malformed records instead of stopping at the first one")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="tokenizing processes (default: the cores); the output is the same for any N")
    p.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                   help="hold out this fraction of the documents (by hash) into OUT/val for eval.*")
    p.add_argument("--val", nargs="+", type=Path, default=[], metavar="INPUT",
                   help="inputs held out into OUT/val (their copies are left out of training)")
    p.set_defaults(func=cmd_prepare)


def _add_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a corpus",
                       description="Tokenizer tools.")
    verbs = p.add_subparsers(title="actions", metavar="ACTION", required=True)
    train = verbs.add_parser(
        "train", help="train a byte-level BPE (Hugging Face tokenizers) on a corpus",
        description="Train a byte-level BPE with the tokenizers library on CORPUS (any input mshpc prepare "
        "reads) and write OUT as a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json; "
        "<|endoftext|> ends documents): pass it to mshpc prepare --tokenizer OUT.")
    train.add_argument("corpus", nargs="+", type=Path, help="record files, saved datasets, text files or folders")
    train.add_argument("--vocab", required=True, type=int, metavar="N", help="vocabulary size, e.g. 32000")
    train.add_argument("--out", required=True, type=Path, metavar="DIR", help="the folder to create")
    train.add_argument("--text-field", default="text", metavar="NAME", help="as mshpc prepare's")
    train.add_argument("--skip-bad-records", action="store_true", help="as mshpc prepare's")
    train.set_defaults(func=cmd_tokenizer_train)


def _add_ckpt(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt", help="inspect or verify checkpoints",
                       description="Read checkpoint folders: a step-* folder or a checkpoints root.")
    verbs = p.add_subparsers(title="actions", metavar="ACTION", required=True)
    inspect = verbs.add_parser("inspect", help="steps, layout, tensors, sizes, age")
    inspect.add_argument("dir", type=Path, help="a step-* folder or a folder of them")
    inspect.add_argument("--tensors", action="store_true", help="also list every tensor")
    inspect.set_defaults(func=cmd_ckpt_inspect)
    verify = verbs.add_parser("verify", help="recompute every checksum; exit 1 on any mismatch")
    verify.add_argument("dir", type=Path, help="a step-* folder or a folder of them")
    verify.set_defaults(func=cmd_ckpt_verify)


def _add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "submit", help="submit a training job to Slurm (or run it locally)",
        description="Submit CONFIG as a Slurm job through submitit: NODES x TASKS_PER_NODE ranks, "
        "checkpointed and requeued before the time limit. Prints the job id and folder (the rendered "
        "sbatch script and per-rank logs); --wait waits and prints the finished run.",
    )
    _add_config_args(p)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--tasks-per-node", type=int, default=None,
                   help="ranks per node (default: one per GPU; on CPU, the config's world / nodes)")
    p.add_argument("--partition", default=None)
    p.add_argument("--time", default="01:00:00", help="Slurm time limit, e.g. 90 or 2-00:00:00")
    p.add_argument("--cluster", default=None, choices=("slurm", "local"),
                   help="default: slurm where srun is on PATH, else local")
    p.add_argument("--folder", default=None, help="job files (default: <run.out_dir>/slurm/<job id>)")
    p.add_argument("--slurm", action="append", default=[], metavar="KEY=VALUE",
                   help="another Slurm parameter, e.g. --slurm account=proj --slurm exclude=n3 (repeatable)")
    p.add_argument("--wait", action="store_true", help="wait for the job and print its result")
    p.set_defaults(func=cmd_submit)


def _add_preflight(sub: argparse._SubParsersAction) -> None:
    from mshpc.preflight.tiers import LEVELS

    p = sub.add_parser(
        "preflight", help="validate nodes: GPU tests, NVML health, collective bandwidth; verdict and exclude list",
        description="Run the pre-flight suite on every rank (one per GPU; per rank on CPU): device tests, "
        "NVML health, collectives and pairwise node links. Prints a table; exits 3 when a node fails, 0 "
        "otherwise (warnings allowed). Knobs: the config's preflight section (--set preflight.key=value).",
    )
    _add_config_args(p, required=False)
    p.add_argument("--level", choices=LEVELS, default="quick",
                   help="quick (< 60 s a node, safe in a Slurm prolog), standard (minutes), extended (burn-in)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="write one record per (node, device, test): value, threshold, unit, status")
    p.add_argument("--exclude-file", type=Path, default=None, metavar="FILE",
                   help="write the failing nodes as a Slurm hostlist, e.g. n[1-3,5] (empty when none fail)")
    p.add_argument("--drain", action="store_true",
                   help="admin: drain failing nodes in Slurm (reason 'mshpc-preflight: ...'; never "
                   "overwrites another reason); not with --level quick")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="local ranks to start outside a launcher (default: one per GPU, 1 on CPU)")
    p.set_defaults(func=cmd_preflight)


def _add_diagnose(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diagnose", help="performance report of a run: MFU, stragglers, per-rank phase times",
        description="Read a run directory (metrics.jsonl, timings/, events.jsonl) and write "
        "RUN_DIR/report/index.html with its figures (opens from disk); print a short summary: "
        "slowest ranks, biggest phase, MFU trend.",
    )
    p.add_argument("run_dir", type=Path, help="a run directory, e.g. runs/tiny")
    p.set_defaults(func=cmd_diagnose)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="predict memory, step time and MFU of every parallel layout",
        description="For every valid (dp, tp, pp, virtual stages, micro-batch, recomputation, ZeRO stage) layout "
        "of --gpus GPUs at the config's global batch (train.micro_batch*train.grad_accum*parallel.dp): "
        "memory per GPU, whether it fits, predicted step time and MFU, best first.",
    )
    _add_config_args(p)
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--gpu", default="h100", help="device type: a100, h100 or h200 (default h100)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-bw", type=float, default=None, metavar="GB/S",
                   help="NCCL bus bandwidth within a node (default: the device table's)")
    p.add_argument("--inter-bw", type=float, default=None, metavar="GB/S",
                   help="NCCL bus bandwidth across nodes per GPU (default: the device table's)")
    p.add_argument("--efficiency", type=float, default=None,
                   help="fraction of the bf16 peak the model's FLOPs run at (default: the table's)")
    p.add_argument("--top", type=int, default=10, help="table rows to show (default 10)")
    p.add_argument("--json", action="store_true", help="every layout as a JSON line, best first")
    p.set_defaults(func=cmd_plan)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face model folder",
        description="Export the latest checkpoint of a run directory (or one step-* folder) as a "
        "transformers model: config.json, model.safetensors (sharded with an index above --max-shard-mb) "
        "and the tokenizer. RMSNorm + SwiGLU + serial blocks become LlamaForCausalLM, LayerNorm + GeLU "
        "GPTNeoXForCausalLM; any other model stops with the nearest supported ones.",
    )
    p.add_argument("path", type=Path, help="a run directory (its latest checkpoint) or a step-* folder")
    p.add_argument("--hf", required=True, type=Path, metavar="OUT_DIR", help="a new (or empty) folder to write")
    p.add_argument("--config", type=Path, default=None,
                   help="the run's config (default: config.yaml of the run directory)")
    p.add_argument("--max-shard-mb", type=float, default=2000.0,
                   help="largest safetensors file, in MB (10^6 bytes); above it, shards and an index (default 2000)")
    p.set_defaults(func=cmd_export)


def _add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import", help="write a config that starts training from a Hugging Face model",
        description="Read HF_DIR/config.json (LlamaForCausalLM or GPTNeoXForCausalLM, safetensors "
        "weights) and write an mshpc config: its model section, train.init_from: HF_DIR, every other "
        "key at its default. `mshpc train` on it starts from those weights.",
    )
    p.add_argument("hf_dir", type=Path, help="a Hugging Face model folder (config.json, *.safetensors)")
    p.add_argument("--out", required=True, type=Path, metavar="CONFIG.yaml", help="the config file to write")
    p.set_defaults(func=cmd_import)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="sample text from a checkpoint",
        description="Continue --prompt with the model of a checkpoint (any dp/tp/pp layout), on this "
        "process, with a key/value cache. Prints the prompt and its continuation.",
    )
    p.add_argument("path", type=Path, metavar="RUN_OR_CHECKPOINT",
                   help="a run directory (its newest checkpoint) or a checkpoint folder")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--greedy", action="store_true", help="the likeliest token every time (deterministic)")
    p.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mshpc", description="MegaScale-style LLM training on Slurm clusters."
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_train(sub)
    _add_prepare(sub)
    _add_tokenizer(sub)
    _add_ckpt(sub)
    _add_submit(sub)
    _add_preflight(sub)
    _add_diagnose(sub)
    _add_plan(sub)
    _add_export(sub)
    _add_import(sub)
    _add_generate(sub)
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    from mshpc.config import load_config, resolve_world
    from mshpc.launch.env import read_launch_env

    cfg = load_config(args.config, args.set)
    env = read_launch_env()
    # One voice: rank 0 logs progress; the others only warnings and errors.
    logging.getLogger().setLevel(logging.INFO if env.rank == 0 else logging.WARNING)
    if args.nproc is not None and args.nproc < 1:
        raise LaunchError(f"--nproc={args.nproc} must be >= 1")
    if env.launcher == "single":
        nproc = args.nproc or cfg.world_size
        if nproc > 1:
            if cfg.parallel.layout == "manual":  # auto fits any world, or says why in the ranks
                resolve_world(cfg, nproc)  # fail here, before starting ranks that would all fail
            from mshpc.checkpoint.paths import checkpoint_root
            from mshpc.launch.supervisor import supervise_local
            from mshpc.run_dir import run_path

            run_dir = run_path(cfg.run)
            return supervise_local(["train", args.config, *_set_args(args)], nproc, supervisor=cfg.supervisor,
                                   spare_nodes=cfg.train.spare_nodes, run_dir=run_dir,
                                   checkpoints=checkpoint_root(cfg.checkpoint, run_dir), recovery=cfg.recovery,
                                   parallel=cfg.parallel)
    elif args.nproc is not None and args.nproc != env.world_size:
        raise LaunchError(f"--nproc={args.nproc} but the {env.launcher} launcher started {env.world_size} ranks")
    from mshpc.train import train

    train(cfg, env)
    return 0


def _set_args(args: argparse.Namespace) -> list[str]:
    return [a for s in args.set for a in ("--set", s)]


def _launch_local(argv: list[str], nproc: int, quiet_exit: int | None = None) -> int:
    """Run `mshpc ARGV` as nproc local ranks; a rank exiting with `quiet_exit` has said why."""
    from mshpc.launch.local import launch_local

    failure = launch_local(argv, nproc)
    if failure is None:
        return 0
    if failure.exit_code != quiet_exit:
        print(f"mshpc: {failure.describe()}", file=sys.stderr)
    return failure.exit_code


def _preflight_argv(args: argparse.Namespace) -> list[str]:
    """The same preflight command, for each local rank."""
    argv = ["preflight", *([args.config] if args.config else []), *_set_args(args), "--level", args.level]
    for flag, value in (("--json", args.json), ("--exclude-file", args.exclude_file)):
        argv += [flag, str(value)] if value is not None else []
    return argv + (["--drain"] if args.drain else [])


def cmd_preflight(args: argparse.Namespace) -> int:
    from mshpc.config import load_config
    from mshpc.launch.env import read_launch_env
    from mshpc.preflight.options import VERDICT_FAIL_EXIT, Options, check_options

    cfg = load_config(args.config, args.set)
    opts = Options(level=args.level, json_path=args.json, exclude_path=args.exclude_file, drain=args.drain)
    check_options(opts)  # before torch is imported, or any rank started
    env = read_launch_env()
    logging.getLogger().setLevel(logging.INFO if env.rank == 0 else logging.WARNING)
    if args.nproc is not None and args.nproc < 1:
        raise LaunchError(f"--nproc={args.nproc} must be >= 1")
    if env.launcher == "single":
        import torch

        nproc = args.nproc or max(1, torch.cuda.device_count())
        if nproc > 1:
            return _launch_local(_preflight_argv(args), nproc, quiet_exit=VERDICT_FAIL_EXIT)
    from mshpc.preflight.run import run_preflight

    return run_preflight(cfg.preflight, env, opts)


def cmd_submit(args: argparse.Namespace) -> int:
    from mshpc.config import parse_yaml
    from mshpc.launch.submit import submit

    extra = {}
    for item in args.slurm:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise LaunchError(f"--slurm {item!r} must look like key=value")
        extra[key] = parse_yaml(value, f"--slurm {item!r}")
    job = submit(args.config, overrides=args.set, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                 tasks_per_node=args.tasks_per_node, partition=args.partition, time=args.time,
                 cluster=args.cluster, folder=args.folder, **extra)
    print(f"submitted job {job.job_id}: folder {job.folder}, run {job.run_dir}")
    if not args.wait:
        return 0
    try:
        result = job.result()
    except LaunchError as exc:
        print(f"mshpc: {exc}", file=sys.stderr)
        return 1
    print(f"finished {result.run_dir}: step {result.steps}, loss {result.final_loss}")
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from mshpc.diagnose.report import write_report

    index, summary = write_report(args.run_dir)
    print("\n".join(summary))
    print(f"report: {index}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from mshpc.data.prepare import PrepareOptions, default_workers, prepare_corpus
    from mshpc.data.records import Reading

    opts = PrepareOptions(tokenizer=args.tokenizer, val_fraction=args.val_fraction, val_inputs=tuple(args.val),
                          reading=Reading(args.text_field, args.skip_bad_records),
                          workers=default_workers() if args.workers is None else args.workers, progress="auto")
    out = prepare_corpus(args.inputs, args.out, opts)
    print(f"prepared {out}")
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from mshpc.data.records import Reading
    from mshpc.data.tokenizer_train import train_tokenizer

    out = train_tokenizer(args.corpus, args.out, args.vocab, Reading(args.text_field, args.skip_bad_records))
    print(f"trained {out} (pass it to mshpc prepare --tokenizer {out})")
    return 0


def cmd_ckpt_inspect(args: argparse.Namespace) -> int:
    from mshpc.checkpoint.tools import inspect

    print(inspect(args.dir, tensors=args.tensors))
    return 0


def cmd_ckpt_verify(args: argparse.Namespace) -> int:
    from mshpc.checkpoint.tools import verify

    good, bad = verify(args.dir)
    for line in good:
        print(line)
    for line in bad:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if bad else 0


def cmd_plan(args: argparse.Namespace) -> int:
    from mshpc.config import load_config
    from mshpc.plan.devices import device_spec
    from mshpc.plan.report import describe_model, format_json, format_table, plan

    cfg = load_config(args.config, args.set)
    dev = device_spec(args.gpu, args.intra_bw, args.inter_bw, args.efficiency)
    predictions = plan(args.gpus, dev, args.gpus_per_node, model_cfg=cfg.model, parallel=cfg.parallel, train=cfg.train,
                       plan_cfg=cfg.plan, recovery=cfg.recovery)
    if args.json:
        print(format_json(predictions))
    else:
        if cfg.model.moe is not None:  # total and active parameters, FLOPs of the routed experts met
            print(describe_model(cfg.model))
        print(format_table(predictions, dev, args.top, plan_cfg=cfg.plan))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mshpc.interop.hf_export import export_hf

    if args.max_shard_mb <= 0:
        raise ConfigError(f"--max-shard-mb={args.max_shard_mb} must be > 0")
    print("\n".join(export_hf(args.path, args.hf, args.config, int(args.max_shard_mb * 1e6))))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from mshpc.interop.hf_import import import_config

    cfg = import_config(args.hf_dir, args.out)
    m = cfg.model
    print(f"wrote {args.out}: {m.norm} + {m.mlp}, {m.n_layer} layers, d_model {m.d_model}, "
          f"{m.n_head} heads ({m.kv_heads} kv), vocabulary {m.vocab_size}; train.init_from: {cfg.train.init_from}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from mshpc.generate import SampleOptions, generate

    opts = SampleOptions(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, args.greedy)
    text, tokens_per_s = generate(args.path, args.prompt, opts)
    print(text)
    print(f"mshpc: {tokens_per_s:.1f} tokens/s", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="mshpc: %(message)s")
    try:
        return args.func(args)
    except MshpcError as exc:
        print_error(exc)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        return 130
