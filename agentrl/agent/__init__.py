"""The agent: token-in-token-out multi-turn episodes (`run_episode`), action formats, trajectories."""

from agentrl.agent.episode import cap_observation, run_episode
from agentrl.agent.trajectory import Trajectory

__all__ = ["Trajectory", "cap_observation", "run_episode"]
