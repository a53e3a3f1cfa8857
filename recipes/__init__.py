"""Built-in recipes (shipped as package data `fsdprun.recipes`); `fsdprun recipes` lists them."""
