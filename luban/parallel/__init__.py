"""The parallel runtime: layouts, device meshes and the engines that train on them."""
