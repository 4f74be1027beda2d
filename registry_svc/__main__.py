from registry_svc.server import main

main()
