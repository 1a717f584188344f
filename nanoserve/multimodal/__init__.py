"""Images in: decoding under limits, each vision family's processor, and the engine-facing
`ImageInput` (an image becomes N embedding rows at placeholder positions of the prompt)."""
