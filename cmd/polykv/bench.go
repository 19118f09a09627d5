package main

import "errors"

func bench(args []string) error { return errors.New("bench: not implemented yet") }
