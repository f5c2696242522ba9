"""Will it fit: the memory of a training step predicted on fake tensors, by batch and by depth."""
