"""What the CLI's verbs do with a job: create it (``create``), validate it against the world (``validate``: data
files, checkpoints, model families), run it (``run``: hf2mg -> GRPO -> mg2hf) and submit it to a cluster
(``submit``). The top floor of mm_rl: it may import every other package, and none imports it."""
