"""`python -m fsdp_lab.checkpoint info|export PATH`: inspect or export a sharded checkpoint in one process."""
from __future__ import annotations

from fsdp_lab.checkpoint import trust
from fsdp_lab.checkpoint.files import CheckpointError
from fsdp_lab.checkpoint.sharded import export_checkpoint

ALLOW_UNVERIFIED_HELP = "load a checkpoint whose manifest records no checksums (its shards cannot be verified)"


def _main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fsdp_lab.checkpoint",
                                     description="Inspect or export an fsdp_lab sharded checkpoint.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="print a checkpoint's step, world size, strategy and model config")
    p_info.add_argument("path")
    p_exp = sub.add_parser("export", help="write a plain torch.save state dict for the plain GPT")
    p_exp.add_argument("path")
    p_exp.add_argument("out")
    p_exp.add_argument("--allow-unverified", action="store_true", help=ALLOW_UNVERIFIED_HELP)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "info":
            found = trust.find(args.path, allow_unverified=True, deep=False)
            if found is None:
                raise CheckpointError(f"no checkpoint in {args.path} yet")
            step_dir, meta = found.step_dir, found.meta
            print(f"{step_dir}: step {meta['step']}, saved by {meta['world_size']} rank(s) with {meta['strategy']}, "
                  f"torch {meta['torch']}\nmodel config: {meta['model_config']}\nunits: "
                  + ", ".join(f"{u['key']} ({u['numel']:,})" for u in meta["units"]))
        else:
            meta = export_checkpoint(args.path, args.out, allow_unverified=args.allow_unverified)
            print(f"wrote {args.out}: step {meta['step']}, {len(meta['state_dict_order'])} tensors; load it with "
                  f"GPT(GPTConfig(**{meta['model_config']})).load_state_dict(torch.load(path))")
    except CheckpointError as err:
        print(f"error: {err}")
        return 4
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
