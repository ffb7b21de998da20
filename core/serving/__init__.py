"""HTTP serving: an OpenAI-compatible FastAPI app over the step-level scheduler's engine thread."""
