"""Model families. Each family is a folder: config.py, model.py (plain nn.Module), hf.py, module.py."""
