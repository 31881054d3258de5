"""Rollout engines: SGLang client (client.py), engine fleet + router (engines.py), default producer
(producer.py). The CPU worker that speaks SGLang's HTTP protocol is a stand-in
(``megatron_m2po/standins/cpu_worker.py``). Import the submodules."""
