package kvevents

import (
	"context"
	"net"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// zmq4's PUB socket says which topics are subscribed, not by how many connections, so
// a second router joining while a first listens would go unnoticed and get no snapshot.
// A tcp endpoint is therefore bound through this transport, plain tcp that counts the
// connections it accepts: each one is a subscriber joining.

const countingScheme = "polykv-tcp"

var (
	registerOnce sync.Once
	// pending hands the counter of the Listen in progress to the transport (zmq4 gives a
	// transport only the address); listenMu keeps Listens one at a time.
	listenMu sync.Mutex
	pending  *atomic.Uint64
)

type countingTransport struct{}

func (countingTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	return d.DialContext(ctx, "tcp", addr)
}

func (countingTransport) Listen(_ context.Context, addr string) (net.Listener, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	return countingListener{Listener: l, n: pending}, nil
}

func (countingTransport) Addr(ep string) (string, error) { return transport.New("tcp").Addr(ep) }

type countingListener struct {
	net.Listener
	n *atomic.Uint64
}

func (l countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil && l.n != nil {
		l.n.Add(1)
	}
	return c, err
}

// countAccepts returns the endpoint to bind and, for tcp, the counter of accepted
// connections (nil for other transports, which keep the first-subscriber snapshot only).
// Bind it with listenCounting.
func countAccepts(endpoint string) (string, *atomic.Uint64) {
	rest, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return endpoint, nil
	}
	registerOnce.Do(func() { _ = zmq4.RegisterTransport(countingScheme, countingTransport{}) })
	return countingScheme + "://" + rest, new(atomic.Uint64)
}

// listenCounting binds sock on ep, handing n to the transport's listener.
func listenCounting(sock zmq4.Socket, ep string, n *atomic.Uint64) error {
	listenMu.Lock()
	defer listenMu.Unlock()
	pending = n
	defer func() { pending = nil }()
	return sock.Listen(ep)
}
