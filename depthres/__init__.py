"""The run machinery that train.py, sample.py and the tools share; model.py knows nothing of it.

    config        train.py's keys, their parsing and the model config built from them
    files         atomic writes and directory locks
    token_data    tokenizers, the token-shard format, meta.json and the loaders
    checkpoint    the run directory, its claim and its checksummed checkpoints
    runlog        log lines, log.jsonl, W&B, progress and MFU
    distributed   how ranks share a run: DDP, FSDP2, agreed errors
    fsdp          FSDP from the meta device, and its sharded checkpoints
    sources       where prepare_data.py's documents come from
    run           a training run's machinery: opening it, its log, signals, divergence, evaluation, summary
"""
