"""agentrl: Ray-native, fully-asynchronous reinforcement learning for agentic LLMs."""

__version__ = "0.1.0"
