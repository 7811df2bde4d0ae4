"""The gateway as the front door for agent traffic: engines it routes OpenAI
requests to (:mod:`.registry`), and which one serves a session's turn
(:mod:`.policy`)."""
