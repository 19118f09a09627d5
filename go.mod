module github.com/polykv/polykv

go 1.26.8

require github.com/ollama/ollama v0.17.4
