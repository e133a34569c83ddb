"""Prompt preparation in the HTTP process: tokenization, chat templates, images and the visual link."""
