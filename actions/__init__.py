"""Chaos Toolkit actions of llmchaos: thin entry points over `llmchaos.faults`.

    actions.gpu       kill_gpu_process
    actions.network   partition_node, heal_partition
    actions.gateway   crash_gateway, restore_gateway
    actions.cache     expire_token_cache
    actions.load      set_qps, inject_burst

Every fault is written to the run's ledger before it is injected; the `llmchaos.control`
control (required) undoes whatever is left at the end of the run, whatever happened.
"""
