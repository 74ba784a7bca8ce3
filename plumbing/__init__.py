"""Prefect plumbing that is neither a flow nor a task, in one room: retry rules and the flow run's retry policy
(policy), one writer per --save and GPU slots (limits), SIGTERM between stages (stopping), what the UI shows —
artifacts, the doctor report, progress (ui). Imports go one way: flows → tasks → plumbing → engine."""
