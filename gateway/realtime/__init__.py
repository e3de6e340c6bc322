"""The OpenAI Realtime API door, /v1/realtime: GA client and server events over a WebSocket, translated onto the same
Session and TurnController as every other door (the event shapes follow the `openai` package's types/realtime)."""
