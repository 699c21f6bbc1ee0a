"""Chaos Toolkit actions of llmchaos: thin entry points over `llmchaos.faults`.

    actions.gpu        kill_gpu_process, hang_gpu_process, resume_gpu_process, gpu_errors,
                       slow_gpu, clear_gpu_fault
    actions.network    partition_node, heal_partition, degrade_network, restore_network
    actions.resources  throttle_cpu, unthrottle_cpu, oom_kill_worker
    actions.gateway    crash_gateway, restore_gateway
    actions.cache      expire_token_cache
    actions.load       set_qps, inject_burst, long_prompt_surge, step_load
    actions.node       drain_node

Every fault is written to the run's ledger before it is injected and checked after it (the
evidence that it took effect is kept in the ledger; a fault not in effect fails the run);
the `llmchaos.control` control (required) undoes whatever is left at the end of the run,
whatever happened.
"""
