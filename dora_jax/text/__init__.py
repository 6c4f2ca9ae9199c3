"""Text below every task and model: tokenizers and the sandbox chat templates run in."""
