// CoreDNS with only the plugins a dev cluster's DNS needs: cluster.local from the Kubernetes API,
// health and readiness. CoreDNS's own main links every plugin (and the cloud SDKs behind route53,
// azure and clouddns), which would triple the build; this is the documented way to choose plugins
// at compile time (a main that imports them and sets dnsserver.Directives in CoreDNS's order).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	// The subset of CoreDNS's plugin.cfg order that this binary links.
	dnsserver.Directives = []string{
		"bind", "ready", "health", "errors", "log", "loadbalance", "cache", "kubernetes",
	}
}

func main() {
	coremain.Run()
}
