// Package wire holds the request and response bodies of PolyKV's HTTP API: the OpenAI
// routes, llama-server's utility routes and the /polykv/* routes, as plain structs with
// JSON tags. It is the one place the public JSON is spelled: internal/api builds these
// values (converting the engine's status values, which carry no tags) and never
// answers a map, and Go clients (the real-model tests in internal/app) decode them.
//
// It is a leaf package (no PolyKV imports) so that a client can use it without the
// engine, and so that the engine's types can change without changing the wire.
//
// Key order is part of the wire: encoding/json writes struct fields in declaration
// order. The replies that were maps before this package existed kept encoding/json's
// sorted map keys, so their structs declare fields in alphabetical order of the JSON
// names; the ones that came from engine structs keep those structs' order. The golden
// tests in internal/api (testdata/golden) compare every route's reply byte for byte.
package wire
