// CoreDNS for the e2e cluster's real nodes, built with only the plugins the
// Corefile that e2e/cluster/real-nodes writes uses, the "build with only the plugins
// you want" pattern CoreDNS documents: its own main package imports every plugin,
// and with them every cloud provider's SDK (route53, azure, clouddns), which the
// cluster never uses and the build would compile.
//
// Which plugins run, and in what order, is still CoreDNS's own: the Corefile names
// them, and dnsserver's fixed directive list orders them.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() {
	coremain.Run()
}
