"""The chat app's screens: the chat itself and the modals it opens."""
