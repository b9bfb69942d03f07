"""The ground floor: what the agent program and the control plane both stand on, below both.

Units (sizes, durations, token budgets), the agent protocol's messages, the engine drivers, a node's facts, ports,
and the confirmation rule. No Django, and no import of any other llmgw package (`.importlinter` keeps it so): a
node runs the agent, and a laptop the CLI, on this alone.
"""
