"""The demo: a tiny GPT on a synthetic world, its data, its LightningModule, the
three demos and the main job. It uses the library and the tools as a user would."""
