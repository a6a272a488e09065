"""The chat app's widgets; each owns its rendering and exposes a small method to update it."""
