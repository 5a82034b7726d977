"""Reference agents. Each module is one agent: a ``Config`` dataclass and an ``Agent`` class.

Agents are named in YAML by import path (``agent: {name: agents.apex_dqn}``), so a
user's own agent is a module anywhere on ``sys.path`` with the same two names.
"""
