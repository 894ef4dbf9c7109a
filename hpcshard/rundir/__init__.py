"""The run directory: the contract between the CLI, the launchers and the ranks, in one
place (stdlib only: it runs on login nodes, in launchers and in every rank).

    RUN_DIR/
        spec.json        the request (`spec`: RunSpec, its only reader and writer)
        attempts.jsonl   one start and one end record per attempt, and the events between
                         (`ledger`; each kind a typed record of `events`)
        metrics.jsonl    rank 0's step records and events (`metrics`)
        checkpoints/     committed DCP checkpoints (`store`)
        launch/          the live launchers' pid files (`launchers`)
        logs/            rank-N.log for every rank

`rankenv` holds every HPCSHARD_* variable a launcher hands its ranks, `status` what
`hpcshard status` makes of all of it, `files` the atomic write they share.
"""
