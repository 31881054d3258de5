"""Rollout engines: SGLang client (client.py), engine fleet + router (engines.py), CPU worker on
SGLang's HTTP protocol (cpu_worker.py), default producer (producer.py). Import the submodules."""
